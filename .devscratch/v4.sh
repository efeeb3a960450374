B="python benchmarks/verifier_throughput.py --inline 0 --repeats 3"
run() { name=$1; shift; env "$@" timeout 150 $B $EXTRA > $OUT/$name.txt 2>&1; echo "== $name"; grep -E "end to end|crash  |GPU gate|boot median|forked worker|honest|repeatab" $OUT/$name.txt | cut -c1-400; }
EXTRA="" run base_c4 X=1
EXTRA="" run le_c4 DICE_EXP_LATE=1 DICE_EXP_EAGER=1
EXTRA="" run base_c4b X=1
EXTRA="" run le_c4b DICE_EXP_LATE=1 DICE_EXP_EAGER=1
EXTRA="" run e_c4 DICE_EXP_EAGER=1
EXTRA="--crash-every 0" run late_c0 DICE_EXP_LATE=1
EXTRA="--crash-every 0" run base_c0 X=1
