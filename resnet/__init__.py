"""ResNet-50 trained with torus gradient summation and distributed batch norm.

``python -m resnet --config=resnet/configs/default.py --workdir=runs/digits`` trains on
the embedded digits; ``train.train_and_evaluate(config, workdir)`` is the library entry.
"""
