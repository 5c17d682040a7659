# tokenmill, installed from the offline bundle: the build needs no network (not even for the base image,
# when BASE_IMAGE is already loaded on the build host).
#   python3 deploy/bundle.py                                   # connected machine: dist/tokenmill-bundle-cpu
#   docker build -t tokenmill .                                # CPU
#   python3 deploy/bundle.py --torch cuda && docker build --build-arg VARIANT=cuda -t tokenmill:cuda .
#   docker run -p 8000:8000 -v tokenmill-data:/var/lib/tokenmill tokenmill      (add --gpus all for cuda)
# The CUDA build of torch carries its CUDA libraries; the host's NVIDIA driver and container toolkit do the rest.
# RUN --mount needs BuildKit (Docker's default builder) or buildah (`buildah bud --format docker`, for HEALTHCHECK).
ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ${BASE_IMAGE}
ARG VARIANT=cpu

RUN useradd --uid 10001 --user-group --no-create-home --no-log-init --home-dir /var/lib/tokenmill --shell /usr/sbin/nologin tokenmill \
    && mkdir -p /var/lib/tokenmill && chown tokenmill:tokenmill /var/lib/tokenmill

# The bundle is mounted, not copied: the image holds the installed venv, not a second copy of every wheel.
RUN --mount=type=bind,source=dist/tokenmill-bundle-${VARIANT},target=/tmp/tokenmill-bundle \
    /tmp/tokenmill-bundle/install.sh --prefix /opt/tokenmill --no-migrate --no-start

ENV PATH=/opt/tokenmill/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    PYTHONUNBUFFERED=1 \
    TOKENMILL_HOST=0.0.0.0 \
    TOKENMILL_PORT=8000 \
    TOKENMILL_DATA_DIR=/var/lib/tokenmill \
    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 \
    NVIDIA_VISIBLE_DEVICES=all NVIDIA_DRIVER_CAPABILITIES=compute,utility

USER tokenmill
WORKDIR /var/lib/tokenmill
VOLUME ["/var/lib/tokenmill"]
EXPOSE 8000
# The first start converts the embedded GGUF into the data volume (about 30 s on 2 cores), hence the grace.
HEALTHCHECK --interval=30s --timeout=5s --start-period=180s --retries=3 \
    CMD python -c "import os, urllib.request as u; u.build_opener(u.ProxyHandler({})).open('http://127.0.0.1:%s/health' % os.environ.get('TOKENMILL_PORT', '8000'), timeout=4)"
ENTRYPOINT ["tokenmill"]
CMD ["serve"]
