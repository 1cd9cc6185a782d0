# Image for real clusters: the node plugin (`timeslice kubelet-plugin`), the controller
# (`timeslice controller`) and, for workloads, the client library. Build and push:
#   docker build -t ghcr.io/timeslice-dra/timeslice:0.1.0 . && docker push ...
# (The local e2e cluster builds an equivalent image without Docker: hack/images.py.)
FROM python:3.11-slim
WORKDIR /src
COPY pyproject.toml README.md ./
COPY client client
COPY driver driver
COPY kubelet_plugin kubelet_plugin
COPY controller controller
COPY cli cli
RUN pip install --no-cache-dir '.[all]' && rm -rf /src
WORKDIR /
CMD ["timeslice", "--help"]
