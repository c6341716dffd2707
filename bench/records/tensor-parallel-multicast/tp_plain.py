"""Probe: a plain vLLM script at tensor_parallel_size N, no raysweep. argv: model tp variant"""
import os, sys, time, json
def main():
    t0 = time.time()
    model, tp, variant = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    kw = {}
    if "nosymm" in variant:
        os.environ["VLLM_ALLREDUCE_USE_SYMM_MEM"] = "0"
    if "nocustom" in variant:
        kw["disable_custom_all_reduce"] = True
    if "nofuse" in variant:
        kw["compilation_config"] = {"pass_config": {"fuse_allreduce_rms": False}}
    if "eager" in variant:
        kw["enforce_eager"] = True
    print(f"[probe] {variant} tp={tp} CVD={os.environ.get('CUDA_VISIBLE_DEVICES')} NVLS={os.environ.get('NCCL_NVLS_ENABLE')} "
          f"SYMM_MC={os.environ.get('TORCH_SYMM_MEM_DISABLE_MULTICAST')} NVSHMEM={os.environ.get('NVSHMEM_DISABLE_NVLS')}", flush=True)
    from vllm import LLM, SamplingParams
    t1 = time.time()
    llm = LLM(model=model, tensor_parallel_size=tp, seed=0, **kw)
    t2 = time.time()
    outs = llm.generate([f"word {i} " * 20 for i in range(256)], SamplingParams(max_tokens=64, temperature=0), use_tqdm=False)
    t3 = time.time()
    print(f"[probe] RESULT {variant} tp={tp} ok import={t1-t0:.1f}s start={t2-t1:.1f}s gen={t3-t2:.1f}s "
          f"tokens={sum(len(o.outputs[0].token_ids) for o in outs)}", flush=True)
    os._exit(0)


if __name__ == '__main__':
    main()
