"""The TrainSpec the RayJob trains: the image holds it at /opt/planaria/train.py (see the
Dockerfile). Replace it with your own; its dataset must read the same data on every node."""

from planaria.examples.tiny_gpt import make_spec

spec = make_spec(global_batch_size=48, micro_batch_size=4)  # 12 micro-batches: up to 12 replicas
