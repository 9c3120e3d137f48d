"""Sessions: the linear session registry (one live channel per client id), the session state it
guards, and the reaper (see ``registry`` for the flow)."""
