"""The data plan and its proof: which samples each step trains on, the ledger of what was
served, randomness that does not depend on the width, integrity checks.
"""
