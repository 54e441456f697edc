"""filtered_probs / sample timings: this tree (table + chunked copy, and with PRE off) against the
base's sampling.py (scratch/base44), CUDA-graph medians, V = 49,216.
python scratch/t/select_ab.py"""
import importlib.util, os, sys
sys.path.insert(0, os.getcwd())
import torch, triton
from kiln.kernels import sampling as S

spec = importlib.util.spec_from_file_location("base_sampling", "scratch/base44/kiln/kernels/sampling.py")
B = importlib.util.module_from_spec(spec); spec.loader.exec_module(B)


def graphed(fn):
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=60, return_mode="median") * 1e3


def main():
    dev, V = "cuda", 49216
    g = torch.Generator(device=dev).manual_seed(0)
    print(f"# {torch.cuda.get_device_name()}, V = {V}; us per call (CUDA-graph medians)")
    print(f"{'rows':>4} {'logits':>8} {'params':>26} {'base':>8} {'table':>8} {'table+copy':>10}  modes")
    cases = [("top-p 0.9", 0, 0.9, 0.0), ("top-k 50 + top-p 0.95", 50, 0.95, 0.0), ("top-p 0.95", 0, 0.95, 0.0),
             ("min-p 0.05", 0, 1.0, 0.05), ("none (T = 1)", 0, 1.0, 0.0), ("top-k 20", 20, 1.0, 0.0)]
    for rows in (1, 8, 64):
        for scale in (3.0, 1.0):
            logits = torch.randn(rows, V, device=dev, generator=g) * scale
            for name, k, p, m in cases:
                if scale == 1.0 and name not in ("top-p 0.9", "top-k 50 + top-p 0.95"):
                    continue
                t = torch.ones(rows, device=dev)
                ks = torch.full((rows,), k, device=dev, dtype=torch.int64)
                ps, ms = torch.full((rows,), p, device=dev), torch.full((rows,), m, device=dev)
                out = {}
                res = {}
                for tag, mod, pre in (("base", B, None), ("table", S, False), ("copy", S, True)):
                    if pre is not None:
                        S.TABLE["PRE"] = pre
                    res[tag] = mod.filtered_probs(logits, t, ks, ps, ms)
                    out[tag] = graphed(lambda: mod.filtered_probs(logits, t, ks, ps, ms))
                S.TABLE["PRE"] = True
                _, _, pre_i = S._select(S._softmax(logits, t), ks, ps, ms, S.CAP)
                modes = sorted(set(pre_i[:, 0].tolist())) if pre_i is not None else "no table"
                same = all(torch.equal(res["base"] > 0, res[x] > 0) for x in ("table", "copy"))
                print(f"{rows:>4} {'randn*' + str(int(scale)):>8} {name:>26} {out['base']:8.1f} {out['table']:8.1f} "
                      f"{out['copy']:10.1f}  {modes} {'same kept sets' if same else 'KEPT SETS DIFFER'}")


if __name__ == "__main__":
    main()
