"""gradstat inside training frameworks: PyTorch Lightning, Hugging Face ``Trainer``, accelerate.

Each integration is an optional extra (``pip install 'gradstat[lightning]'``,
``'gradstat[transformers]'``), imported only when its module is imported. accelerate needs
no module: its models are plain ``DistributedDataParallel`` after ``prepare`` (see
docs/integrations.md for the three lines).
"""
