"""Adapters to AWS services: the only code that makes SDK clients."""
