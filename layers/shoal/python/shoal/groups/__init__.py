"""Shared groups: the members of a ``$share`` subscription lease its streams (KCL vocabulary:
lease, owner, take, renew, evict, checkpoint)."""
