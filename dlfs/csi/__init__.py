"""`dlfs csi`: a Kubernetes CSI node plugin. The CSI spec's Identity and Node services over gRPC on a
Unix socket publish dataset versions into pods, read-only; the pods of one node that ask for the same
version share one dlfs mount (and so one cache), bind-mounted into each of them.

csi.proto is the spec's own (v1.12.0), kept verbatim; csi_pb2*.py are generated from it by
scripts/gen-csi-stubs.sh and committed, so running the plugin needs grpcio and protobuf, never protoc.
"""

DRIVER_NAME = "csi.dlfs.io"  # the CSIDriver object's name, and what GetPluginInfo answers
