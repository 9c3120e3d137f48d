"""The HTTP frame of the API functions: resolver and error map, bodies, the caller."""
