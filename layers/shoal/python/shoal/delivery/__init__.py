"""Delivery: durable subscriptions, session inboxes, get and ack (see ``service`` for the flow)."""
