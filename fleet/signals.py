"""What the fleet announces to the floors above it (they connect; the fleet imports none of them)."""

from django.dispatch import Signal

# A node stopped sending heartbeats and went offline (node=Node, reason=str): whatever ran
# there is lost. The jobs app ends those attempts (as infra) and requeues their jobs.
node_offline = Signal()

# The burn-in wants a node's stress step run (node_id=int). A receiver that is that node's
# agent runs it and returns its Result; the others return None, and then it is sent to the
# node's queue instead.
stress_here = Signal()

# The node page is drawn (node=Node, user=User): receivers return a dict of extra context
# (the jobs app adds the attempts of the user's projects that ran there).
node_page = Signal()

# A node changed state (node=Node, previous=str, audit=AuditEvent: its action, reason, actor and
# evidence), sent inside the change's transaction, if any: the jobs app notifies subscribers
# of cordons and uncordons after commit (jobs/notify.py).
node_state_changed = Signal()
