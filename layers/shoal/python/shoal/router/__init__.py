"""The router: fans each batch of a storage stream out to inboxes and group streams
(``fanout``), archives it (``archive``), and runs the two in order for the handler (``batch``)."""
