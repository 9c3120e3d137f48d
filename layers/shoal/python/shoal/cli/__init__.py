"""The ``shoal`` command (``main``): ``shoal dev`` and ``shoal token`` (``dev``), ``shoal publish``
and ``shoal subscribe`` (``pubsub``), ``shoal pipeline``."""
