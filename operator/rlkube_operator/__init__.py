"""rlkube's Kubernetes operator: reconciles RLJob custom resources into KubeRay RayJobs."""
