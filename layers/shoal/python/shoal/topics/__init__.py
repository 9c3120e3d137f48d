"""MQTT topic names and filters: validity, matching, $share, and the filter index."""
