source .gpu/run.sh
python benchmarks/results/experiments/ce_fused_l2_probe.py 2>&1 | tee $OUT/ce_fused_l2_h200.txt
