"""The Python client of the Shoal API: the client itself (``http.ShoalClient``), its state file
(``state``), its values (``support``: retry policy, results, messages) and errors (``errors``)."""
