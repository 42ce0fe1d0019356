"""Output-length predictor (BERT-family) used by the router (paper §3.4). Not built yet."""
