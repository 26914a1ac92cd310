"""What crosses between the controller and the workers: the store's keys and the calls'
reports.
"""
