"""A small WebSocket deployment for ``shoal.local.websocket``'s tests: an authorizer and an
edge function of their own, so the server is tested apart from the real ``wsauth``/``edge``."""
