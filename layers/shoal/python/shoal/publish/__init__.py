"""Publishing: the request (``request``), publisher sequences and their reservations
(``sequences``), retained messages (``retained``), the Kinesis writer (``writer``), a request's
messages on their way (``items``) and the path that ties them together, exactly once by
sequence (``service``)."""
