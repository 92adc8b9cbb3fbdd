"""The paper's scale: ResNet-50 on ImageNet over a 32x32-chip 2-D torus, batch 32768.

Run on every host of the pod slice (TPU runtimes give the process count and id):

  python -m resnet --config=resnet/configs/pod.py --workdir=gs://<bucket>/runs/pod \
      --config.data_dir=gs://<bucket>/tensorflow_datasets

The mesh is 32x32 devices, one per chip (TPU v4 and newer). On TPU v3, whose chips show
two devices each, pass ``--config.mesh_shape='(32, 64)'``. With 32 examples per device,
batch norm statistics span two devices (64 examples), the paper's setting.
"""

from resnet.configs import imagenet


def get_config():
  c = imagenet.get_config(global_batch=32_768)
  c.mesh_shape = (32, 32)
  c.eval_batch_size = 32_768
  c.log_every_steps = 10
  c.eval_every_epochs = 4.0
  c.checkpoint_every_steps = 200
  return c
