"""The datastore's card (README.md), written from its eval.json by `specd datastore`."""
from __future__ import annotations

from pathlib import Path

from specd_train.drafter.answers import SAMPLED_EVERY, SAMPLED_TEMPERATURE


def write_card(out: Path, report: dict) -> None:
    cfg, m = report["config"], report["machine"]
    rows = []
    for name, r in report["held_out"].items():
        own, ds = r["own"], r["datastore"]
        rows.append(f"| {name} | {r['prompts']} | {r['answer_tokens']:,} | {own['tokens_per_step']:.3f} | "
                    f"{ds['tokens_per_step']:.3f} | {ds['tokens_per_step'] / own['tokens_per_step']:.3f}x | "
                    f"{own['propose_us']:.0f} | {ds['propose_us']:.0f} |")
    text = "\n".join([
        f"# {out.name}",
        "",
        f"A datastore for the suffix index (`suffix_decoding_datastore`, specd/proposers/datastore.py): "
        f"{cfg['target']}'s own answers to {cfg['conversations']:,} conversations, {cfg['tokens']:,} tokens, "
        f"stored as uint32 ids end to end (`datastore.npz`, {report['file_bytes'] / 1e6:.1f} MB compressed). "
        "The index drafts the tokens that most often followed the longest suffix of the context in these "
        "answers where the request's own history has no draft (retrieval drafting, as REST, He et al. 2024; "
        "SuffixDecoding's global tree filled ahead of time). Drafts are verified as any other, so the output "
        "stays exactly the target's; another target with the same tokenizer can draft from it too (not measured how well).",
        "",
        "`specd up` drafts from the default target's datastore by default (what it gives served: "
        "[docs/methods.md](../../docs/methods.md)). Another one: `specd up --drafter draft_model --local-drafter "
        f"'suffix:{{\"suffix_decoding_datastore\": \"{out}\"}}'`, or the same `--local-drafter` on `specd verifier`. "
        "A target whose vocabulary differs is refused (`vocab_hash`).",
        "",
        "## Data",
        "",
        f"Shards 0..{cfg['shards'] - 1} of `specd drafter-data` (training/specd_train/drafter/data.py): questions "
        "the target asked itself from its chat template (three in four) and built prompts (stdlib code edits, "
        "explanations and summaries from the training split, everyday questions), answered greedily (one in "
        f"{SAMPLED_EVERY} sampled at T {SAMPLED_TEMPERATURE}) in bfloat16, at most {cfg['data_recipe']['max_tokens']} tokens; the held-out "
        "benchmark questions are refused wherever they come up. Only the answers are kept. Making the shards "
        f"took {cfg['made_in_s'] / 60:.0f} min of decoding here (summed per shard, at batch "
        f"{', '.join(map(str, cfg['made_at']['batch']))} and {', '.join(map(str, cfg['made_at']['threads']))} "
        "threads, some beside other work).",
        "",
        "## Held-out replay",
        "",
        "The held-out workloads (training/specd_train/workloads.py; nothing in the data asks them) answered "
        "greedily in bfloat16, replayed through the serving suffix proposer as the verifier drives it (k up to "
        "8, the cache of finished answers off, so no held-out answer drafts another): tokens a step count the "
        "target's own token, so 1.0 is plain decoding; a propose call's mean time, in this process.",
        "",
        "| workload | prompts | answer tokens | tokens/step, own history | with the datastore | ratio | "
        "propose us, own | with the datastore |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
        *rows,
        "",
        f"Machine: {m['cpu']} (family/model {m['family_model']}), flags {' '.join(m['flags'])}, {m['cores']} "
        f"cores, {m['threads']} torch threads; Python {m['python']}, torch {m['torch']}. Date: {m['date']}.",
        "",
        "## Reproduce",
        "",
        f"`{cfg['command']}` (deterministic where the bf16 matmul path is the same: "
        "`torch.ops.specd_cpu.bf16_matmul_path`, AMX tiles, vdpbf16ps and FMAs round differently).",
        "",
        f"License: Apache-2.0, as the target ({cfg['target']}, Hugging Face), whose outputs these are.",
        "",
    ])
    (out / "README.md").write_text(text)
