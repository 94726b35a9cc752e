"""Kubernetes-facing sources: conversion of Kubernetes objects into the model, and the sources that feed
it (manifest files; later the API server)."""
