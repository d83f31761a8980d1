"""Coordination: who this process is in the job (``group``) and the line from the writer to its peers
(``channel``: phases and the outcome published in the group's store, bounded waits)."""
