source .gpu/run.sh
python benchmarks/results/experiments/lora_mlp_wall_probe.py 2>&1 | tee $OUT/lora_mlp_wall_h200.txt
