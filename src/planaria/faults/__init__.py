"""Faults: the error hierarchy and its one classifier, whose fault an error is, chaos
injection, and the fault campaign.
"""
