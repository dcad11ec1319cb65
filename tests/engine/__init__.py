"""Tests of zeroshard/engine/."""
