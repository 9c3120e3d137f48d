"""Push subscriptions: a composite topic's messages POSTed to an HTTP endpoint."""
