"""Fault campaigns: seeded faults over the whole mix, checked against a fault-free reference.

``planaria campaign SCRIPT.py[:SPEC] --faults N --seed S`` (see
:mod:`planaria.faults.campaign.runner`).
"""

from planaria.faults.campaign.mix import KINDS, MixConfig, PlannedFault, PlannedRun, plan_campaign

__all__ = ["KINDS", "MixConfig", "PlannedFault", "PlannedRun", "plan_campaign"]
