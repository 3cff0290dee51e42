"""The verdict: decision, runbook checklist, report record."""
