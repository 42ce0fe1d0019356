"""Request routing (paper §3.4). :mod:`router.routing` holds the pure routing logic shared with
the cluster simulator (routing table, least-loaded choice, migration rule); on top of it
:mod:`router.gateway` is the OpenAI-compatible gateway (aiohttp) that routes requests to vPods
by that table, with P/D hand-off, migration and fail-over (helpers: :mod:`router.openai_api`,
:mod:`router.upstream`, :mod:`router.predict`)."""
