"""The compiled variants' results file as lesson 07 and the README read it: the best variant
(``decoder_tokens.best_variant``), the README's sentence rendered from the file (``variants_readme_line``), its block
rewritten by ``update_variants_readme``, and the README's block checked against the committed file, so that the
README's numbers cannot drift from the run they cite. CPU only: nothing here runs a model."""

from __future__ import annotations

import copy
import json

import pytest

from wb_kernels.bench.results import REPO_ROOT
from wb_kernels.bench import decoder_tokens as tokens

COMMITTED = REPO_ROOT / "results" / "decode" / "decoder_variants_h100.json"


def _record(variant, ms, fraction, verdict="identical", context=1024, vs_baseline=None):
    return {"kind": "decoder_variant", "variant": variant, "context": context, "status": "ok", "ms_per_step": ms,
            "fraction_of_roofline": fraction, "greedy_verdict": verdict, "vs_baseline": vs_baseline}


def _results(records, contexts=(1024,)):
    return {"kind": "decoder_variants", "mode": "gpu", "roofline_bar": 0.6,
            "environment": {"gpu": "Some GPU", "git_commit": "abc1234"},
            "settings": {"config": "llama_1b", "dtype": "float16", "attend": "wb", "contexts": list(contexts),
                         "variants": ["reduce-overhead", "coordinate-descent", "max-autotune"]},
            "records": records}


def test_the_best_variant_is_the_fastest_whose_tokens_are_not_suspect():
    results = _results([_record("reduce-overhead", 1.5, 0.56), _record("coordinate-descent", 1.2, 0.7, "suspect"),
                        _record("max-autotune", 1.4, 0.6, "agree to rounding", vs_baseline=1.07),
                        _record("coordinate-descent", 1.0, 0.8, context=4096)], contexts=(1024, 4096))
    assert tokens.best_variant(results, 1024)["variant"] == "max-autotune"  # the faster suspect one is passed over
    assert tokens.best_variant(results, 4096)["ms_per_step"] == 1.0
    assert tokens.best_variant(results, 8192) is None


def test_the_readme_line_says_each_variant_the_verdicts_and_the_bar():
    met = _results([_record("reduce-overhead", 1.5, 0.571), _record("coordinate-descent", 1.25, 0.66,
                                                                     vs_baseline=1.2),
                    {"variant": "max-autotune", "context": 1024, "status": "skipped", "reason": "not started"}])
    line = tokens.variants_readme_line(met, source="results/x.json")
    assert "Some GPU at commit abc1234 (`results/x.json`)" in line
    assert "reduce-overhead 1.500 ms (57.1 %), coordinate-descent 1.250 ms (66.0 %)" in line
    assert "max-autotune skipped (not started)" in line
    assert "greedy tokens identical to the eager decoder's for every variant timed" in line
    assert line.endswith("best coordinate-descent, 1.200x reduce-overhead: the bar of 60 % of the roofline is met.")
    short = copy.deepcopy(met)
    short["records"][1].update(fraction_of_roofline=0.59, greedy_verdict="agree to rounding")
    line = tokens.variants_readme_line(short, source="results/x.json")
    assert line.endswith("the bar of 60 % of the roofline is not met.")
    assert "reduce-overhead identical, coordinate-descent agree to rounding" in line
    for record in short["records"][:2]:
        record["greedy_verdict"] = "suspect"
    assert "no variant timed with its tokens checked" in tokens.variants_readme_line(short, source="x")


def test_update_variants_readme_rewrites_only_its_block(tmp_path):
    path = tmp_path / "decoder_variants_gpu.json"
    path.write_text(json.dumps(_results([_record("reduce-overhead", 1.5, 0.571)])))
    readme = tmp_path / "README.md"
    readme.write_text(f"# T\nbefore\n{tokens.README_VARIANTS_START}\nold line\n{tokens.README_VARIANTS_END}\nafter\n")
    tokens.update_variants_readme(path, readme)
    text = readme.read_text()
    assert "old line" not in text and text.startswith("# T\nbefore\n") and text.endswith("end -->\nafter\n")
    assert "reduce-overhead 1.500 ms (57.1 %)" in text
    tokens.update_variants_readme(path, readme)
    assert readme.read_text() == text  # idempotent
    readme.write_text("# no block\n")
    with pytest.raises(ValueError, match="decoder-variants:start"):
        tokens.update_variants_readme(path, readme)


def test_readme_has_the_variants_block_and_it_matches_the_committed_file():
    text = (REPO_ROOT / "README.md").read_text()
    start, end = tokens.README_VARIANTS_START, tokens.README_VARIANTS_END
    assert text.count(start) == 1 and text.count(end) == 1
    block = text.split(start, 1)[1].split(end, 1)[0].strip("\n")
    relative = str(COMMITTED.relative_to(REPO_ROOT))
    expected = tokens.variants_readme_line(json.loads(COMMITTED.read_text()), source=relative)
    assert block == expected, (
        "README.md's variants line is stale: run python -c \"from wb_kernels.bench import decoder_tokens as t; "
        f"t.update_variants_readme('{relative}')\"")


def test_the_committed_file_says_what_the_lesson_and_the_readme_say():
    # the facts the README's line and lesson 07 state, from the file itself (the lesson asserts them too)
    results = json.loads(COMMITTED.read_text())
    assert results["kind"] == "decoder_variants" and results["mode"] == "gpu"
    assert results["environment"]["gpu"].startswith("NVIDIA H100")
    best = tokens.best_variant(results, 1024)
    assert best["variant"] == "coordinate-descent-pdl" and results["roofline_bar"] <= best["fraction_of_roofline"]
    assert all(r["greedy_verdict"] == "identical" for r in results["records"] if r["status"] == "ok")
