"""Composite topics (Varadhi): storage topics, the produce pointer and the router formula."""
