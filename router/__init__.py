"""Request routing (paper §3.4). :mod:`router.routing` holds the pure routing logic shared with
the cluster simulator (routing table, least-loaded choice, migration rule); the
OpenAI-compatible gateway on top of it is a later issue."""
