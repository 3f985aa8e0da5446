"""A layer and inputs whose router logits tie exactly, and the layer's output computed in
fp64 with the documented tie rule (kernels/router.h: equal probabilities go to the lower
expert index), for test_router_ties.py and test_cuda_executor.py.

The attention adds nothing (o_proj = 0), so y = x + MoE(rmsnorm(x) * w_post). The router
weight is zero but in two columns J and J2, so a token's logits are a[e] * h[J] + b[e] * h[J2]
with one of the two terms zero: exact in fp32 whatever a kernel's summation order (the other
products are exact zeros), so experts with equal a (or b) tie exactly. Three kinds of token:
  A: h[J] > 0, h[J2] = 0: logits ~ a; experts 3 and 5 tie for the 4th and last slot;
  B: h[J] = 0, h[J2] > 0: logits ~ b; 0, 2, 3 and 6 tie for the last two slots;
  C: h[J] = h[J2] = 0: every logit is 0, every expert ties.
"""
import torch

E, K = 8, 4
HIDDEN, INTER = 40, 24
J, J2 = 5, 17
A = [0.5, 2.0, 2.5, 1.0, 3.0, 1.0, -2.0, -1.0]
B = [1.0, 3.0, 1.0, 1.0, 0.0, 3.0, 1.0, -1.0]
# the experts each kind of token must use, by the rule
CHOSEN = {"A": [4, 2, 1, 3], "B": [1, 5, 0, 2], "C": [0, 1, 2, 3]}
EPS = 1e-6


def config(q3):
    return q3.LayerConfig(hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2, head_dim=12,
                          num_experts=E, num_experts_per_tok=K, moe_intermediate_size=INTER,
                          norm_topk_prob=True, rms_norm_eps=EPS)


def weights(seed=0):
    """fp32 weights by checkpoint name: random matrices scaled by 1/sqrt(fan_in), norm weights
    near 1 (1 at J and J2, so h keeps x's sign there), o_proj zero, the tie router"""
    g = torch.Generator().manual_seed(seed)

    def mat(*shape):
        return torch.randn(*shape, generator=g) * shape[-1] ** -0.5

    def norm(n):
        return 1 + 0.2 * torch.randn(n, generator=g)

    post = norm(HIDDEN)
    post[J] = post[J2] = 1.0
    router = torch.zeros(E, HIDDEN)
    router[:, J], router[:, J2] = torch.tensor(A), torch.tensor(B)
    return {
        "input_layernorm.weight": norm(HIDDEN),
        "self_attn.q_proj.weight": mat(48, HIDDEN), "self_attn.k_proj.weight": mat(24, HIDDEN),
        "self_attn.v_proj.weight": mat(24, HIDDEN), "self_attn.o_proj.weight": torch.zeros(HIDDEN, 48),
        "self_attn.q_norm.weight": norm(12), "self_attn.k_norm.weight": norm(12),
        "post_attention_layernorm.weight": post, "mlp.gate.weight": router,
        "mlp.experts.gate_up_proj": mat(E, 2 * INTER, HIDDEN), "mlp.experts.down_proj": mat(E, HIDDEN, INTER),
    }


def tokens(kinds, seed=1):
    """x [len(kinds), HIDDEN] fp32, one token of each kind ('A', 'B' or 'C') in turn"""
    x = torch.randn(len(kinds), HIDDEN, generator=torch.Generator().manual_seed(seed))
    for i, kind in enumerate(kinds):
        x[i, J] = 0.0 if kind != "A" else x[i, J].abs() + 0.5
        x[i, J2] = 0.0 if kind != "B" else x[i, J2].abs() + 0.5
    return x


def top_k(p, lower_first=True):
    """the k experts of highest probability; ties to the lower index (or, to show that the
    rule matters, to the higher)"""
    return sorted(range(E), key=lambda e: (-p[e], e if lower_first else -e))[:K]


def reference(w, x, lower_first=True):
    """y [T, HIDDEN] in fp64 and the experts chosen for each token"""
    x = x.double()
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w["post_attention_layernorm.weight"].double()
    probs = torch.softmax(h @ w["mlp.gate.weight"].double().T, dim=-1)
    gate_up, down = w["mlp.experts.gate_up_proj"].double(), w["mlp.experts.down_proj"].double()
    y, chosen = x.clone(), []
    for t in range(x.shape[0]):
        sel = top_k(probs[t].tolist(), lower_first)
        chosen.append(sel)
        p = probs[t, sel] / probs[t, sel].sum()
        for e, pe in zip(sel, p):
            gu = gate_up[e] @ h[t]
            y[t] += pe * (down[e] @ (torch.nn.functional.silu(gu[:INTER]) * gu[INTER:]))
    return y, chosen
