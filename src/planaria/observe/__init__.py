"""What a run tells: the event log, metrics, goodput, reports, live progress, Prometheus,
logging.
"""
