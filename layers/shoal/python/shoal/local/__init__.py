"""The local runtime behind ``shoal dev``: moto on loopback, the gateway, the emulated triggers."""
