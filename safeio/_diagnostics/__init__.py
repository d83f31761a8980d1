"""Diagnostics: the writer's watchdog (stalls become warnings with stacks), writer-only sections (a
collective where only the writer runs raises instead of deadlocking), and the audit sanitizer."""
