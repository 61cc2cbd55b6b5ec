# The engine image: vLLM's OpenAI server, as the fleet supervisor's engine pods and the chart's static engines run
# it (`python3 -m vllm.entrypoints.openai.api_server`), made to run as the non-root uid the pods require.
#   docker build -f infra/docker/engine.Dockerfile -t REGISTRY/tidal-engine:0.32.0 .
# The chart's vllm.image names it (fleet.kubernetes.image refuses an untagged or 'latest' image).

# Pinned: the vLLM release the engine environment and the chart's default are on (requirements/engine-cpu.txt,
# vllm.image.tag in infra/helm/tidal/values.yaml).
FROM vllm/vllm-openai:v0.32.0

# Caches on the pods' writable volumes (the root filesystem is read-only): the same paths the supervisor's
# engine pods set (serving/runtime/k8s_manifest.py).
ENV HOME=/tmp/home \
    XDG_CACHE_HOME=/cache \
    HF_HOME=/cache/huggingface \
    VLLM_CACHE_ROOT=/cache/vllm \
    VLLM_NO_USAGE_STATS=1 \
    DO_NOT_TRACK=1

RUN groupadd --gid 10001 tidal \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp/home --shell /usr/sbin/nologin tidal

USER 10001:10001
ENTRYPOINT ["python3", "-m", "vllm.entrypoints.openai.api_server"]
