import tempfile, copy, torch, json
from pathlib import Path
from tests import quant_checkpoints as qc
from tests.tiny_models import model_class
import hp_fastload as hf
from transformers import FineGrainedFP8Config
root = Path(tempfile.mkdtemp())
model = qc.build_model("qwen3_moe")
t = qc.released(model, root)
q = qc.quantize_fp8_block(t, (4, 8))
qc.rewrite(root, q, dict(qc.FP8_CONFIG, weight_block_size=[4, 8]))
refm = model_class("qwen3_moe").from_pretrained(root, dtype=torch.bfloat16, quantization_config=FineGrainedFP8Config(weight_block_size=(4,8), dequantize=True))
print({k: v.dtype for k, v in list(refm.state_dict().items())[:6]})
m = copy.deepcopy(model)
r = hf.load(m, root)
print(r.summary())
sd, rsd = m.state_dict(), refm.state_dict()
print("keys differ", set(sd) ^ set(rsd))
bad = [k for k in rsd if k in sd and not torch.equal(sd[k], rsd[k].to(sd[k].dtype))]
print("mismatch", bad)
