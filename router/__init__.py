"""Request routing: the sequence-length -> vPod-group routing table and the OpenAI-compatible
gateway (paper §3.4). Not built yet: see the open issues."""
