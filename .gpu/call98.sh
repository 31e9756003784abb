source .gpu/run.sh
python -m pytest -q -p no:cacheprovider -n 8 packages/fk-norms/tests/test_poly_norm.py 2>&1 | tail -2
start=$(date +%s)
python benchmarks/bench_norms.py --ops poly_norm --out $OUT/norms_poly.json --plot-dir $OUT/plots 2>&1 | grep -v "Warning: \|_warn_once\|^  warnings.warn\|Backend impl" | tail -2
echo "bench took $(( $(date +%s) - start )) s"
