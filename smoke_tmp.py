import tempfile, copy, torch, json
from pathlib import Path
from tests import quant_checkpoints as qc
from tests.tiny_models import model_class
from safetensors.torch import load_file, save_file
import hp_fastload as hf
root = Path(tempfile.mkdtemp()); ref = Path(tempfile.mkdtemp())
model = qc.build_model("deepseek_v3")
t = qc.released(model, root)
q = qc.quantize_fp8_block(t, (8, 8))
qc.rewrite(root, q, dict(qc.FP8_CONFIG, weight_block_size=[8, 8]))
deq = {k: (qc.weight_dequant(v, q[k+"_scale_inv"], (8,8), torch.bfloat16) if k+"_scale_inv" in q else v) for k, v in q.items() if not k.endswith("_scale_inv")}
model.save_pretrained(ref)
save_file(deq, str(ref/"model.safetensors"), metadata={"format":"pt"})
refm = model_class("deepseek_v3").from_pretrained(ref, dtype=torch.bfloat16)
for loader in ["dcp", "legacy"]:
    m = copy.deepcopy(model)
    with torch.no_grad():
        for p in m.parameters(): p.zero_()
    r = hf.load(m, root, loader=loader)
    print(loader, r.summary(), r.unexpected_keys)
    sd, rsd = m.state_dict(), refm.state_dict()
    bad = [k for k in rsd if not torch.equal(sd[k], rsd[k])]
    print("mismatch", bad)
