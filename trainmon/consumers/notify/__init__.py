"""``trainmon consume notify``: alert delivery, a sink on the consumer runtime reading the
alert topic with its own group -- to Alertmanager, to apprise URLs, and to actions (a
command run per incident). See :mod:`.sink` and docs/notify.md."""
