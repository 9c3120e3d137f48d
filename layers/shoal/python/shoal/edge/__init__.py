"""The WebSocket edge: a session's whole life over API Gateway's WebSocket API, in JSON text
frames, with deliveries pushed to the connection (DESIGN.md, "Push").

``frames`` is the protocol core without I/O: what each frame may hold, read by the handlers and
by the published contract (``docs/asyncapi.yaml``) alike. ``service`` answers client frames,
``push`` hands a connected session its deliveries through ``@connections``.
"""
