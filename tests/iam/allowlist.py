"""Granted but never seen used in the integration and end-to-end suites: each with its reason.

The check of calls against roles (``tests.iam``) reports, per function, the actions its role
allows that none of its recorded calls needed. Each must be here with why it stays granted (a
path the suites do not reach, a grant CDK makes as a set); one that is used after all, or that
no role has any more, must leave the list. ``("*", action)`` stands for every function.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Unused:
    reason: str


#: Whether a full run fails on an unused grant missing here (or an entry no longer unused).
#: False until the list is filled from a full run's report (``SHOAL_IAM_REPORT=1`` prints it):
#: issue 32's helper could not run the whole suite on its machine. Report only until then.
ENFORCED = False

UNUSED_GRANTS: dict[tuple[str, str], Unused] = {}
