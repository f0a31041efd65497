"""kvgate chaos drills: break a live deployment on purpose and report what survived.

``kvgate chaos list`` names the drills; ``kvgate chaos run DRILL...`` runs them against a deployment each drill
starts for itself (``--spawn``, the default) or a running one on this host (``--url``). Each drill plans a load,
injects its fault, accounts for every request it sent and reads the deployment's own /metrics and ledger
afterwards; see chaos/RESULTS.md for a full run.
"""
