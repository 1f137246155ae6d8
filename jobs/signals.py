"""What the jobs app announces; receivers connect in their own modules."""

from django.dispatch import Signal

# An attempt ended (attempt=Attempt, job=JobMoved: the job as that end left it), sent inside
# the transaction that ended it: its cost is added there (jobs/models/cost.py), and its MLflow
# run is ended after commit (jobs/tracking.py).
attempt_finished = Signal()

# A job ended without an attempt ending (job=Job): a queued job cancelled. (A job that ends
# with its attempt is announced by attempt_finished.) Sent inside the cancel's transaction.
job_ended = Signal()
