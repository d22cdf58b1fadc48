import sys, types
import torch.nn.functional as F
import tailorkv.engine.policies.snapkv as S
k = int(sys.argv.pop(1))
S.F = types.SimpleNamespace(max_pool1d=lambda x, kernel, stride=1, padding=0: F.avg_pool1d(x, k, stride=1, padding=k // 2))
from tailorkv.cli import main
main()
