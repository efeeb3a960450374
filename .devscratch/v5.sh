B="python benchmarks/verifier_throughput.py --inline 0 --repeats 5"
run() { name=$1; shift; timeout 150 $B "$@" > $OUT/$name.txt 2>&1; echo "== $name"; grep -E "end to end|crash  |GPU gate|boot median|forked worker|honest|repeatab" $OUT/$name.txt | cut -c1-400; }
run new_c4
run new_c0 --crash-every 0
run new_c4b
