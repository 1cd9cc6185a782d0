# Image for real clusters: the node plugin (`timeslice kubelet-plugin`), the controller
# (`timeslice controller`) and, for workloads, the client library. Build and push:
#   docker build -t ghcr.io/timeslice-dra/timeslice:0.1.0 . && docker push ...
# (The local e2e cluster builds an equivalent image without Docker: hack/images.py.)
# The wheel is built in a stage with a C compiler (the timeslice-vmm shim, shim/timeslice_vmm.c);
# the image itself gets only the built wheel.
FROM python:3.11-slim AS build
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY shim shim
COPY client client
COPY driver driver
COPY kubelet_plugin kubelet_plugin
COPY controller controller
COPY cli cli
RUN pip wheel --no-cache-dir --no-deps -w /wheels .

FROM python:3.11-slim
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir "$(ls /wheels/timeslice_dra-*.whl)[all]" && rm -rf /wheels
CMD ["timeslice", "--help"]
